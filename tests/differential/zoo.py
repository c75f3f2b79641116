"""Tiny `transformers` models of every architectural family tessel must partition correctly.

Each entry builds a model from its config (random weights, seeded) and example inputs for a
batch size; the model returns plain tensors, so eager and partitioned outputs compare directly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

HIDDEN, HEADS, LAYERS, VOCAB, SEQ = 64, 4, 2, 256, 16


class Logits(torch.nn.Module):
    """A causal or masked LM called with input ids, returning its logits."""

    def __init__(self, model: torch.nn.Module, **call: object) -> None:
        super().__init__()
        self.model = model
        self.call = call

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, **self.call).logits


class Hidden(torch.nn.Module):
    """An encoder called with one input, returning its last hidden state."""

    def __init__(self, model: torch.nn.Module, arg: str = "input_ids") -> None:
        super().__init__()
        self.model = model
        self.arg = arg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(**{self.arg: x}).last_hidden_state


class Seq2Seq(torch.nn.Module):
    """An encoder-decoder called with encoder ids and decoder ids, returning the logits."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(
            input_ids=input_ids, decoder_input_ids=decoder_input_ids, use_cache=False
        ).logits


@dataclass(frozen=True)
class Family:
    """One architecture: what it exercises and how to build it with inputs."""

    name: str
    features: str
    make: Callable[[], torch.nn.Module]
    inputs: Callable[[int, int], tuple[torch.Tensor, ...]]  # (batch, seed) -> inputs


def _ids(batch: int, seed: int = 0, seq: int = SEQ, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + batch)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def _seeded(build: Callable[[], torch.nn.Module]) -> Callable[[], torch.nn.Module]:
    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return build().eval()

    return make


def lm(config_cls: str, model_cls: str, **config: object) -> Callable[[], torch.nn.Module]:
    """A maker of `transformers`' `model_cls` with this config, seeded, returning its logits."""

    def build() -> torch.nn.Module:
        import transformers

        cfg = getattr(transformers, config_cls)(**config)
        return Logits(getattr(transformers, model_cls)(cfg), use_cache=False)

    return _seeded(build)


DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=2 * HIDDEN,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    max_position_embeddings=64,
)


def _bert() -> torch.nn.Module:
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=2 * HIDDEN,
        max_position_embeddings=64,
    )
    return Hidden(BertModel(cfg, add_pooling_layer=False))


def _t5() -> torch.nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=VOCAB,
        d_model=HIDDEN,
        d_kv=HIDDEN // HEADS,
        d_ff=2 * HIDDEN,
        num_layers=LAYERS,
        num_decoder_layers=LAYERS,
        num_heads=HEADS,
        decoder_start_token_id=0,
    )
    return Seq2Seq(T5ForConditionalGeneration(cfg))


def _vit() -> torch.nn.Module:
    from transformers import ViTConfig, ViTModel

    cfg = ViTConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=2 * HIDDEN,
        image_size=32,
        patch_size=8,
    )
    return Hidden(ViTModel(cfg, add_pooling_layer=False), "pixel_values")


def _mamba() -> torch.nn.Module:
    from transformers import MambaConfig, MambaForCausalLM

    cfg = MambaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, state_size=8, expand=2
    )
    return Logits(MambaForCausalLM(cfg), use_cache=False)


def _pixels(batch: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1000 * seed + batch)
    return (torch.randn(batch, 3, 32, 32, generator=g),)


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        Family(
            "gpt2",
            "learned positions, tied embeddings, Conv1D",
            lm(
                "GPT2Config",
                "GPT2LMHeadModel",
                vocab_size=VOCAB,
                n_embd=HIDDEN,
                n_layer=LAYERS,
                n_head=HEADS,
                n_positions=64,
                bos_token_id=0,
                eos_token_id=0,
            ),
            lambda b, seed=0: (_ids(b, seed),),
        ),
        Family(
            "llama",
            "GQA, RoPE, RMSNorm, SwiGLU",
            lm("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2, **DECODER),
            lambda b, seed=0: (_ids(b, seed),),
        ),
        Family(
            "mistral",
            "sliding-window attention, GQA",
            lm(
                "MistralConfig",
                "MistralForCausalLM",
                num_key_value_heads=2,
                sliding_window=8,
                **DECODER,
            ),
            lambda b, seed=0: (_ids(b, seed),),
        ),
        Family(
            "gemma2",
            "logit soft-capping, alternating sliding window, tied embeddings",
            lm(
                "Gemma2Config",
                "Gemma2ForCausalLM",
                num_key_value_heads=2,
                head_dim=HIDDEN // HEADS,
                sliding_window=8,
                **DECODER,
            ),
            lambda b, seed=0: (_ids(b, seed),),
        ),
        Family(
            "falcon",
            "parallel attention, multi-query",
            lm(
                "FalconConfig",
                "FalconForCausalLM",
                vocab_size=VOCAB,
                hidden_size=HIDDEN,
                num_hidden_layers=LAYERS,
                num_attention_heads=HEADS,
            ),
            lambda b, seed=0: (_ids(b, seed),),
        ),
        Family(
            "gpt_neox",
            "parallel attention, partial rotary",
            lm("GPTNeoXConfig", "GPTNeoXForCausalLM", **DECODER),
            lambda b, seed=0: (_ids(b, seed),),
        ),
        Family(
            "phi3",
            "fused qkv and gate-up projections",
            lm("Phi3Config", "Phi3ForCausalLM", pad_token_id=0, **DECODER),
            lambda b, seed=0: (_ids(b, seed),),
        ),
        Family(
            "opt",
            "learned positions with offset, tied embeddings",
            lm(
                "OPTConfig",
                "OPTForCausalLM",
                vocab_size=VOCAB,
                hidden_size=HIDDEN,
                ffn_dim=2 * HIDDEN,
                num_hidden_layers=LAYERS,
                num_attention_heads=HEADS,
                max_position_embeddings=64,
                word_embed_proj_dim=HIDDEN,
            ),
            lambda b, seed=0: (_ids(b, seed),),
        ),
        Family(
            "bloom",
            "ALiBi, tied embeddings",
            lm("BloomConfig", "BloomForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=2),
            lambda b, seed=0: (_ids(b, seed),),
        ),
        Family(
            "mixtral",
            "mixture of experts, top-2 routing",
            lm(
                "MixtralConfig",
                "MixtralForCausalLM",
                num_key_value_heads=2,
                num_local_experts=4,
                num_experts_per_tok=2,
                **DECODER,
            ),
            lambda b, seed=0: (_ids(b, seed),),
        ),
        Family(
            "deepseek_v3",
            "multi-head latent attention, routed and shared experts",
            lm(
                "DeepseekV3Config",
                "DeepseekV3ForCausalLM",
                num_key_value_heads=HEADS,
                n_routed_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=HIDDEN // 2,
                n_group=1,
                topk_group=1,
                first_k_dense_replace=1,
                q_lora_rank=HIDDEN // 2,
                kv_lora_rank=HIDDEN // 4,
                qk_rope_head_dim=8,
                qk_nope_head_dim=8,
                v_head_dim=HIDDEN // HEADS,
                **DECODER,
            ),
            lambda b, seed=0: (_ids(b, seed),),
        ),
        Family("bert", "bidirectional encoder", _seeded(_bert), lambda b, seed=0: (_ids(b, seed),)),
        Family(
            "t5",
            "encoder-decoder, relative position bias",
            _seeded(_t5),
            lambda b, seed=0: (_ids(b, seed), _ids(b, seed + 7, seq=8)),
        ),
        Family("vit", "vision transformer, patch convolution", _seeded(_vit), _pixels),
        Family(
            "mamba",
            "selective state-space model",
            _seeded(_mamba),
            lambda b, seed=0: (_ids(b, seed),),
        ),
        Family(
            "xglm",
            "sinusoidal positions (a detached table), scaled embeddings, tied embeddings",
            lm(
                "XGLMConfig",
                "XGLMForCausalLM",
                vocab_size=VOCAB,
                d_model=HIDDEN,
                ffn_dim=2 * HIDDEN,
                num_layers=LAYERS,
                attention_heads=HEADS,
                max_position_embeddings=64,
            ),
            lambda b, seed=0: (_ids(b, seed),),
        ),
    ]
}
