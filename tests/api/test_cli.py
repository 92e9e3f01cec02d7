"""The command line: every sub-command end to end on a small model, help text, exit code 2."""
import pytest

from memopt.cli import build_parser, main


@pytest.mark.slow
def test_report_export_bench_and_estimate_run(tmp_path, capsys):
    assert main(["report", "tiny_resnet", "--batch", "2", "--top", "3"]) == 0
    assert "memopt report: TinyResNet" in capsys.readouterr().out
    assert main(["export", "mlp", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "plan.json").exists()
    assert main(["bench", "mlp", "--steps", "1"]) == 0
    assert "memopt / stock" in capsys.readouterr().out
    assert main(["estimate", "cnn", "--top", "2"]) == 0


def test_a_callable_model_with_an_input_shape(capsys):
    assert main(["report", "memopt.testing.zoo:MLP", "--input-shape", "32", "--batch", "4"]) == 0
    assert "memopt report: MLP" in capsys.readouterr().out


def test_timm_models_by_name(capsys):
    pytest.importorskip("timm")
    assert main(["report", "timm:resnet10t", "--batch", "2", "--input-shape", "3,32,32", "--top", "2"]) == 0
    assert "ResNet (captured by symbolic_trace" in capsys.readouterr().out
    assert main(["estimate", "convnext_atto", "--batch", "1", "--input-shape", "3,32,32", "--top", "1"]) == 0
    assert "ConvNeXt" in capsys.readouterr().out


def test_demo_writes_its_picture_and_says_where(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "demo.png"
    assert main(["demo", "--batch", "2", "--top", "2", "--plot", str(path)]) == 0
    assert path.stat().st_size > 0 and str(path) in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["report", "nope"], "unknown model 'nope'"),
    (["report", "memopt.testing.zoo:MLP"], "needs --input-shape"),
    (["report", "no.such.module:f", "--input-shape", "3"], "cannot load model 'no.such.module:f'"),
    (["report", "mlp", "--input-shape", "3,x"], "must be comma-separated ints"),
    (["report", "mlp", "--budget-mb", "-1"], "--budget-mb must be a positive number of MiB, got -1.0"),
    (["bench", "mlp", "--steps", "0"], "expected a positive int, got '0'"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["report", "timm:nope"], "unknown timm model 'nope'"),
])
def test_bad_arguments_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_every_option_has_help():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in subparsers.items():
        for action in sub._actions:
            if action.dest != "help":
                assert action.help, f"{name} {action.dest} has no help text"


def test_a_bad_option_value_is_one_line_and_exit_code_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["estimate", "mlp", "--device", "tpu"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "memopt: error: Config.device='tpu' is not supported; use None or one of ['cpu', 'cuda', 'meta']" in err
    assert "Traceback" not in err
