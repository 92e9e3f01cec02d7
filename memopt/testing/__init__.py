"""Test helpers shipped with memopt: the model zoo and the autograd audit."""
