"""python -m tools.support_table   (a few minutes on 2 CPU cores)

Which model families memopt captures, rewrites and trains: tries each and writes a table.

For each model (random weights, built from configs; nothing is downloaded): capture path, whether
a training forward is bit-identical to the original, saved activation bytes before/after at the
defaults (estimated; checked against memopt.measure), and the techniques that applied.
Writes docs/support.md.
"""
from __future__ import annotations

import argparse
import copy
import traceback
from pathlib import Path
from typing import Callable, Dict, Tuple

import torch
from tabulate import tabulate

import memopt
from memopt.core.units import fmt_bytes
from memopt.record.plan import option_decisions


def _models() -> Dict[str, Tuple[str, Callable[[], torch.nn.Module], Callable[[], object]]]:
    import timm
    import torchvision
    import transformers as T

    from memopt.testing.reversible_zoo import RevNetCNN, RevTransformer
    from memopt.testing.zoo import ZOO, PreActResNet, TinyViT

    small = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256)
    image = lambda size=32: (lambda: torch.randn(4, 3, size, size))  # noqa: E731
    tokens = lambda: {"input_ids": torch.randint(0, 1000, (4, 32))}  # noqa: E731
    tv = lambda name: (lambda: getattr(torchvision.models, name)(weights=None))  # noqa: E731
    tm = lambda name, **kw: (lambda: timm.create_model(name, pretrained=False, num_classes=10, **kw))  # noqa: E731
    return {
        "PreAct ResNet-20 (memopt zoo)": ("CNN", lambda: PreActResNet(20), image()),
        "ViT (memopt zoo)": ("transformer", lambda: TinyViT(), image(16)),
        "RevNet CNN (memopt zoo)": ("reversible", lambda: RevNetCNN((4, 4)), image(16)),
        "reversible transformer (memopt zoo)": ("reversible", lambda: RevTransformer(4), image(16)),
        "early-exit ResNet (Python loop on a tensor value)": (
            "not capturable whole", lambda: ZOO["early_exit"].build()[0], lambda: ZOO["early_exit"].build()[1]),
        "ResNet-50": ("torchvision", tv("resnet50"), image(64)),
        "MobileNetV2": ("torchvision", tv("mobilenet_v2"), image(64)),
        "VGG-11-BN": ("torchvision", tv("vgg11_bn"), image(32)),
        "DenseNet-121": ("torchvision", tv("densenet121"), image(32)),
        "EfficientNet-B0": ("torchvision", tv("efficientnet_b0"), image(64)),
        "ViT (2 layers, hidden 128)": (
            "torchvision", lambda: torchvision.models.VisionTransformer(32, 16, 2, 4, 128, 256), image(32)),
        "BERT": ("transformers", lambda: T.BertModel(T.BertConfig(vocab_size=1000, **small)), tokens),
        "GPT-2": ("transformers", lambda: T.GPT2LMHeadModel(T.GPT2Config(
            n_embd=128, n_layer=2, n_head=4, vocab_size=1000, bos_token_id=0, eos_token_id=0, use_cache=False)),
            tokens),
        "Llama": ("transformers", lambda: T.LlamaForCausalLM(T.LlamaConfig(
            vocab_size=1000, num_key_value_heads=2, use_cache=False, **small)), tokens),
        "ViT": ("transformers", lambda: T.ViTModel(T.ViTConfig(image_size=32, patch_size=8, **small)),
                lambda: {"pixel_values": torch.randn(4, 3, 32, 32)}),
        "ResNet-26-D": ("timm", tm("resnet26d"), image()),
        "EfficientNet-B0 (timm)": ("timm", tm("efficientnet_b0"), image()),
        "ConvNeXt-atto": ("timm", tm("convnext_atto"), image()),
        "DeiT-tiny": ("timm", tm("deit_tiny_patch16_224", img_size=32), image()),
        "MLP-Mixer S/32": ("timm", tm("mixer_s32_224", img_size=64), image(64)),
    }


def _first(out):
    if isinstance(out, torch.Tensor):
        return out
    return next(v for v in (out.values() if hasattr(out, "values") else out) if isinstance(v, torch.Tensor))


def try_model(make, inputs) -> Dict[str, str]:
    torch.manual_seed(0)
    model = make().train()
    x = inputs()
    reference = copy.deepcopy(model)
    call = (lambda m: m(**x)) if isinstance(x, dict) else (lambda m: m(x))
    try:
        om = memopt.optimize(model, example_inputs=x, optimizer="adamw")
    except memopt.MemoptError as e:
        return {"capture": "refused", "note": str(e).splitlines()[0][:120]}
    torch.manual_seed(1)
    out = _first(call(om))
    torch.manual_seed(1)
    equal = torch.equal(out, _first(call(reference)))
    out.float().pow(2).mean().backward()
    measured = memopt.measure(om, x, optimizer="adamw").saved_bytes
    techniques = sorted({t for u in om.plan.units for t, _, _ in option_decisions(u["chosen"])})
    return {"capture": om.plan.capture, "forward identical": "yes" if equal else "NO",
            "saved before": fmt_bytes(om.plan.baseline_saved_bytes),
            "saved after": fmt_bytes(om.plan.estimated_saved_bytes),
            "estimate = measured": "yes" if measured == om.plan.estimated_saved_bytes else f"NO ({fmt_bytes(measured)})",
            "techniques": ", ".join(techniques) or "none", "note": ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="docs/support.md")
    args = parser.parse_args()
    rows = []
    for name, (family, make, inputs) in _models().items():
        try:
            result = try_model(make, inputs)
        except Exception as e:  # noqa: BLE001 - the table records what failed
            traceback.print_exc()
            result = {"capture": "error", "note": f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"}
        rows.append({"family": family, "model": name, **result})
        print(rows[-1], flush=True)
    headers = ["family", "model", "capture", "forward identical", "saved before", "saved after",
               "estimate = measured", "techniques", "note"]
    table = tabulate([[r.get(h, "") for h in headers] for r in rows], headers=headers, tablefmt="github")
    text = ("# Model support\n\nCommand: `python -m tools.support_table` (torch "
            f"{torch.__version__}, CPU). Defaults (`memopt.Config()`, no budget), AdamW, small inputs; "
            "saved bytes are the cost model's estimate, compared with `memopt.measure`.\n\n" + table + "\n")
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
