"""The sweep's model zoo: every torchvision classifier, one model per timm family, Hugging Face architectures
from tiny configs; each built with random weights and the smallest input it accepts (used by
``sweep_soundness``)."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

FAMILIES = ("torchvision", "timm", "hf")
HEAVY_PARAMS = 100_000_000
BATCH = 2
IMAGE_SIZES = (32, 64, 96, 128, 160, 224, 256, 299)

# One model per timm family (timm module): the variant with the fewest parameters among
# timm.list_models(module=family), counted on the meta device (timm test_* models left out where the family
# has a real one); 49 of timm's 98 families, covering CNNs, mobile CNNs, hybrids, ViTs and MLP models.
TIMM_MODELS = [
    # CNNs
    "resnet10t", "resnetv2_18", "legacy_seresnet18", "skresnet18", "resnest14d", "res2next50", "tresnet_m",
    "regnetx_002", "densenet121", "dla46x_c", "dpn48b", "cs3darknet_focus_s", "ese_vovnet19b_slim_dw",
    "hrnet_w18_small", "xception41p", "inception_v3", "nf_regnet_b0", "hgnetv2_b0", "mobileone_s1",
    "convnext_zepto_rms", "starnet_s050",
    # mobile CNNs
    "mobilenetv2_035", "mobilenetv3_small_050", "ghostnet_050", "rexnet_100", "repvit_m1", "fastvit_t8",
    # hybrids and efficient transformers
    "mobilevit_xxs", "edgenext_xx_small", "levit_128s", "efficientformerv2_s0", "efficientvit_m0", "coat_tiny",
    "convit_tiny", "pvt_v2_b0", "twins_svt_small", "pit_ti_224", "xcit_nano_12_p8_224", "tiny_vit_5m_224",
    "maxvit_pico_rw_256", "vit_tiny_r_s16_p8_224",
    # ViTs, Swin, MLP / pooling mixers
    "vit_tiny_patch16_224", "deit_tiny_patch16_224", "beit_base_patch16_224", "vit_tiny_patch16_dinov3_qkvb",
    "swin_tiny_patch4_window7_224", "gmlp_ti16_224", "poolformerv2_s12", "mambaout_femto",
]


# ------------------------------------------------------------------------------------------- the zoo
def torchvision_names() -> List[str]:
    import torchvision
    return list(torchvision.models.list_models(module=torchvision.models))


def _image(size: int) -> Callable[[], Any]:
    import torch
    return lambda: torch.randn(BATCH, 3, size, size)


def _restore(model, buffers) -> None:
    import torch
    with torch.no_grad():
        for (_, b), saved in zip(model.named_buffers(), buffers):
            b.copy_(saved)


def _accepts(model, size: int) -> bool:
    """A train-mode forward at ``size`` (no grad; buffers and RNG restored after)."""
    import torch
    buffers = [b.detach().clone() for _, b in model.named_buffers()]
    rng = torch.get_rng_state()
    try:
        with torch.no_grad():
            model(torch.randn(BATCH, 3, size, size))
        return True
    except Exception:  # noqa: BLE001 - too small for this model: try the next size
        return False
    finally:
        _restore(model, buffers)
        torch.set_rng_state(rng)


def _smallest(make: Callable[[Optional[int]], Any], sized: bool, sizes=IMAGE_SIZES):
    """(model, size) at the smallest accepted size; ``make(size)`` builds for ``size`` when ``sized``."""
    import torch
    model = None if sized else make(None)
    last = None
    for size in sizes:
        if sized:
            torch.manual_seed(0)
            try:
                model = make(size)
            except Exception as e:  # noqa: BLE001
                last = e
                continue
        if _accepts(model.train(), size):
            return model, size
    raise RuntimeError(f"no input size in {sizes} accepted" + (f" (last build error: {last})" if last else ""))


def build_torchvision(name: str, min_size: int = IMAGE_SIZES[0]):
    import torchvision
    sizes = tuple(s for s in IMAGE_SIZES if s >= min_size)
    builder = getattr(torchvision.models, name)
    if name.startswith("vit_"):  # the patch embedding fixes the size; one patch grid of 2x2 (1x1 for /32)
        patch = int(name.rsplit("_", 1)[1])
        size = 2 * patch if patch < 32 else 32
        return builder(weights=None, image_size=size), size
    if name == "maxvit_t":
        return _smallest(lambda s: builder(weights=None, input_size=(s, s)), sized=True, sizes=(224,))
    if name in ("googlenet", "inception_v3"):
        return _smallest(lambda s: builder(weights=None, init_weights=True), sized=False, sizes=sizes)
    return _smallest(lambda s: builder(weights=None), sized=False, sizes=sizes)


def build_timm(name: str, min_size: int = IMAGE_SIZES[0]):
    import timm
    sizes = tuple(s for s in IMAGE_SIZES if s >= min_size)

    def make(size):
        kw = {} if size is None else {"img_size": size}
        return timm.create_model(name, pretrained=False, num_classes=10, **kw)

    first: Dict[int, Any] = {}
    try:
        first[sizes[0]] = make(sizes[0])
        takes_size = True
    except TypeError:
        takes_size = False
    except Exception:  # noqa: BLE001 - takes img_size, but not this one
        takes_size = True
    return _smallest(lambda size: first.pop(size) if size in first else make(size), sized=takes_size, sizes=sizes)


def _tokens(vocab: int, seq: int = 12, **extra):
    import torch

    def make():
        d = {"input_ids": torch.randint(4, vocab, (BATCH, seq))}
        for k, v in extra.items():
            d[k] = torch.randint(4, vocab, (BATCH, v))
        return d
    return make


def _pixels(size: int, channels: int = 3):
    import torch
    return lambda: {"pixel_values": torch.randn(BATCH, channels, size, size)}


def hf_models() -> Dict[str, Tuple[Callable[[], Any], Callable[[], Any], str]]:
    """name -> (make model, make inputs, input description)."""
    import torch
    import transformers as T

    V = 512
    enc = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
               max_position_embeddings=64)
    dec = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
               max_position_embeddings=64, use_cache=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vit = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
               intermediate_size=64)
    tok = ("input_ids (2, 12)", _tokens(V))
    px = ("pixel_values (2, 3, 32, 32)", _pixels(32))

    def whisper():
        from transformers.models.whisper.modeling_whisper import WhisperEncoder
        return WhisperEncoder(T.WhisperConfig(vocab_size=V, d_model=32, encoder_layers=2, encoder_attention_heads=2,
                                              encoder_ffn_dim=64, decoder_layers=1, decoder_attention_heads=2,
                                              decoder_ffn_dim=64, num_mel_bins=16, max_source_positions=8,
                                              max_target_positions=16))

    speech = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                  conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                  num_conv_pos_embedding_groups=2, vocab_size=V)
    audio = ("input_values (2, 400)", lambda: {"input_values": torch.randn(BATCH, 400)})
    seq2seq = ("input_ids (2, 12), decoder_input_ids (2, 8)", _tokens(V, decoder_input_ids=8))
    lm = lambda cls, cfg, **kw: (lambda: cls(cfg(**{**dec, **kw})))  # noqa: E731
    models = {
        "BERT": (lambda: T.BertModel(T.BertConfig(**enc)), *tok),
        "RoBERTa": (lambda: T.RobertaModel(T.RobertaConfig(**{**enc, "max_position_embeddings": 66})), *tok),
        "XLM-RoBERTa": (lambda: T.XLMRobertaModel(T.XLMRobertaConfig(**{**enc, "max_position_embeddings": 66})), *tok),
        "DistilBERT": (lambda: T.DistilBertModel(T.DistilBertConfig(vocab_size=V, dim=32, n_layers=2, n_heads=2,
                                                                    hidden_dim=64, max_position_embeddings=64)), *tok),
        "ALBERT": (lambda: T.AlbertModel(T.AlbertConfig(embedding_size=16, **enc)), *tok),
        "ELECTRA": (lambda: T.ElectraModel(T.ElectraConfig(embedding_size=32, **enc)), *tok),
        "DeBERTa": (lambda: T.DebertaModel(T.DebertaConfig(**enc)), *tok),
        "DeBERTa-v2": (lambda: T.DebertaV2Model(T.DebertaV2Config(**enc)), *tok),
        "MPNet": (lambda: T.MPNetModel(T.MPNetConfig(**{**enc, "max_position_embeddings": 66})), *tok),
        "ModernBERT": (lambda: T.ModernBertModel(T.ModernBertConfig(
            vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
            sep_token_id=2)), *tok),
        "GPT-2": (lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=2,
                                                         n_positions=64, use_cache=False, bos_token_id=1,
                                                         eos_token_id=2)), *tok),
        "GPT-Neo": (lambda: T.GPTNeoForCausalLM(T.GPTNeoConfig(
            vocab_size=V, hidden_size=32, num_layers=2, num_heads=2, attention_types=[[["global", "local"], 1]],
            max_position_embeddings=64, window_size=8, use_cache=False)), *tok),
        "GPT-J": (lambda: T.GPTJForCausalLM(T.GPTJConfig(vocab_size=V, n_embd=32, n_layer=2, n_head=2, rotary_dim=8,
                                                         n_positions=64, use_cache=False)), *tok),
        "GPT-NeoX": (lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**dec)), *tok),
        "CodeGen": (lambda: T.CodeGenForCausalLM(T.CodeGenConfig(vocab_size=V, n_embd=32, n_layer=2, n_head=2,
                                                                 rotary_dim=8, n_positions=64, use_cache=False)),
                    *tok),
        "OPT": (lambda: T.OPTForCausalLM(T.OPTConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                                                     num_attention_heads=2, word_embed_proj_dim=32,
                                                     max_position_embeddings=64, use_cache=False)), *tok),
        "BLOOM": (lambda: T.BloomForCausalLM(T.BloomConfig(vocab_size=V, hidden_size=32, n_layer=2, n_head=2,
                                                           use_cache=False)), *tok),
        "Llama": (lm(T.LlamaForCausalLM, T.LlamaConfig, num_key_value_heads=1), *tok),
        "Mistral": (lm(T.MistralForCausalLM, T.MistralConfig, num_key_value_heads=1), *tok),
        "Mixtral (MoE)": (lm(T.MixtralForCausalLM, T.MixtralConfig, num_key_value_heads=1, num_local_experts=4,
                             num_experts_per_tok=2), *tok),
        "Qwen2": (lm(T.Qwen2ForCausalLM, T.Qwen2Config, num_key_value_heads=1), *tok),
        "Qwen3": (lm(T.Qwen3ForCausalLM, T.Qwen3Config, num_key_value_heads=1, head_dim=16), *tok),
        "Gemma": (lm(T.GemmaForCausalLM, T.GemmaConfig, num_key_value_heads=1, head_dim=16), *tok),
        "Gemma2": (lm(T.Gemma2ForCausalLM, T.Gemma2Config, num_key_value_heads=1, head_dim=16), *tok),
        "Phi": (lm(T.PhiForCausalLM, T.PhiConfig), *tok),
        "Phi-3": (lm(T.Phi3ForCausalLM, T.Phi3Config), *tok),
        "Falcon": (lambda: T.FalconForCausalLM(T.FalconConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                                              num_attention_heads=2, use_cache=False)), *tok),
        "OLMo": (lm(T.OlmoForCausalLM, T.OlmoConfig, num_key_value_heads=1), *tok),
        "T5 encoder": (lambda: T.T5EncoderModel(T.T5Config(vocab_size=V, d_model=32, d_kv=16, d_ff=64,
                                                           num_layers=2, num_heads=2)), *tok),
        "T5 (encoder-decoder)": (lambda: T.T5Model(T.T5Config(vocab_size=V, d_model=32, d_kv=16, d_ff=64,
                                                              num_layers=1, num_decoder_layers=1, num_heads=2,
                                                              use_cache=False)), *seq2seq),
        "BART": (lambda: T.BartModel(T.BartConfig(vocab_size=V, d_model=32, encoder_layers=1, decoder_layers=1,
                                                  encoder_attention_heads=2, decoder_attention_heads=2,
                                                  encoder_ffn_dim=64, decoder_ffn_dim=64,
                                                  max_position_embeddings=64, use_cache=False)), *seq2seq),
        "ViT": (lambda: T.ViTModel(T.ViTConfig(**vit)), *px),
        "DeiT": (lambda: T.DeiTModel(T.DeiTConfig(**vit)), *px),
        "BEiT": (lambda: T.BeitModel(T.BeitConfig(**vit, use_relative_position_bias=True)), *px),
        "DINOv2": (lambda: T.Dinov2Model(T.Dinov2Config(**vit)), *px),
        "CLIP vision": (lambda: T.CLIPVisionModel(T.CLIPVisionConfig(**vit)), *px),
        "Swin": (lambda: T.SwinModel(T.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                                                  num_heads=[1, 2], window_size=4)), *px),
        "ConvNeXt": (lambda: T.ConvNextModel(T.ConvNextConfig(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1])), *px),
        "ResNet": (lambda: T.ResNetModel(T.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                                        layer_type="basic")), *px),
        "MobileViT": (lambda: T.MobileViTModel(T.MobileViTConfig(image_size=64)),
                      "pixel_values (2, 3, 64, 64)", _pixels(64)),
        "SegFormer": (lambda: T.SegformerModel(T.SegformerConfig(num_encoder_blocks=2, depths=[1, 1],
                                                                 sr_ratios=[2, 1], hidden_sizes=[16, 32],
                                                                 patch_sizes=[7, 3], strides=[4, 2],
                                                                 num_attention_heads=[1, 2], mlp_ratios=[2, 2])),
                      *px),
        "Whisper encoder": (whisper, "input_features (2, 16, 16)",
                            lambda: {"input_features": torch.randn(BATCH, 16, 16)}),
        "Wav2Vec2": (lambda: T.Wav2Vec2Model(T.Wav2Vec2Config(**speech)), *audio),
        "HuBERT": (lambda: T.HubertModel(T.HubertConfig(**speech)), *audio),
    }
    return {name: (make, inputs, desc) for name, (make, desc, inputs) in models.items()}


def names(family: str) -> List[str]:
    if family == "torchvision":
        return torchvision_names()
    if family == "timm":
        return list(TIMM_MODELS)
    return list(hf_models())


def build(family: str, name: str, min_size: int = IMAGE_SIZES[0]):
    """(model in train mode, inputs, input description), random weights, seeded; images at least ``min_size``
    (the smallest size in IMAGE_SIZES from there that the model accepts)."""
    import torch
    torch.manual_seed(0)
    if family == "hf":
        make, inputs, desc = hf_models()[name]
        model = make()
        torch.manual_seed(1)
        return model.train(), inputs(), desc
    model, size = build_torchvision(name, min_size) if family == "torchvision" else build_timm(name, min_size)
    torch.manual_seed(1)
    return model.train(), _image(size)(), f"(2, 3, {size}, {size})"


def count_params(family: str, name: str) -> int:
    """Parameters, counted on the meta device; where a model's init cannot run there (torchvision's RegNetY reads
    a value), on the CPU; 0 if that fails too. The sweeps skip models by this count before building them:
    a 0 for regnet_y_128gf (644M parameters) let a sweep build and plan it until the kernel killed it."""
    import torch

    def build():
        if family == "torchvision":
            import torchvision
            return getattr(torchvision.models, name)(weights=None)
        if family == "timm":
            import timm
            return timm.create_model(name, pretrained=False, num_classes=10)
        return hf_models()[name][0]()

    for device in ("meta", "cpu"):
        try:
            with torch.device(device):
                return sum(p.numel() for p in build().parameters())
        except Exception:  # noqa: BLE001
            continue
    return 0
