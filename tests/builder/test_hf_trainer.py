"""The Hugging Face Trainer at its defaults trains an optimized module (issue 39): it keeps the dataset columns the
model's forward names, finds the labels (eval_loss), saves the model's state dict under the model's keys, and the
saved weights reload into a fresh model; accelerate's prepare() takes it too."""
import pytest
import torch

import memopt

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from torch.utils.data import Dataset  # noqa: E402


class Tokens(Dataset):
    def __init__(self, n=32, seq=16):
        g = torch.Generator().manual_seed(0)
        self.ids, self.labels = torch.randint(0, 100, (n, seq), generator=g), torch.randint(0, 2, (n,), generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.labels[i],
                "unused_column": i}


def tiny_bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32)
    return transformers.BertForSequenceClassification(config)


def run(model, data, directory):
    args = transformers.TrainingArguments(output_dir=str(directory), per_device_train_batch_size=8,
                                          per_device_eval_batch_size=8, num_train_epochs=1, report_to=[],
                                          use_cpu=True, save_strategy="no", seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, eval_dataset=data)
    loss = trainer.train().training_loss
    return trainer, loss, trainer.evaluate()


@pytest.mark.slow
def test_trainer_trains_evaluates_and_saves_an_optimized_module(tmp_path):
    data = Tokens()
    example = {k: torch.stack([data[i][k] for i in range(8)]) for k in ("input_ids", "attention_mask", "labels")}
    model = tiny_bert()
    om = memopt.optimize(model, example_inputs=example)
    assert om.config is model.config and om.main_input_name == "input_ids"
    trainer, loss, metrics = run(om, data, tmp_path / "memopt")
    _, stock_loss, stock_metrics = run(tiny_bert(), data, tmp_path / "stock")
    assert "eval_loss" in metrics, metrics
    assert abs(loss - stock_loss) < 0.01 and abs(metrics["eval_loss"] - stock_metrics["eval_loss"]) < 0.01
    trainer.save_model(str(tmp_path / "saved"))
    fresh = tiny_bert()
    from safetensors.torch import load_file
    state = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert set(state) <= set(fresh.state_dict())
    fresh.load_state_dict(state, strict=False)
    for name, p in model.named_parameters():
        assert torch.equal(fresh.get_parameter(name), p), name


@pytest.mark.slow
def test_accelerate_prepare_takes_an_optimized_module():
    from accelerate import Accelerator

    data = Tokens(n=8)
    example = {k: torch.stack([data[i][k] for i in range(8)]) for k in ("input_ids", "attention_mask", "labels")}
    model = tiny_bert()
    om = memopt.optimize(model, example_inputs=example)
    accelerator = Accelerator(cpu=True)
    prepared, opt = accelerator.prepare(om, torch.optim.AdamW(model.parameters(), lr=1e-3))
    before = [p.detach().clone() for p in model.parameters()]
    loss = prepared(**example).loss
    accelerator.backward(loss)
    opt.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert accelerator.unwrap_model(prepared) is om
