"""The `transformers` families generation is checked on, token for token against
`transformers`' own `generate` of each prompt alone: every causal LM of the differential suite's
zoo, and families built for generation alone (ALiBi, a model taking its arguments through
`**kwargs`, hybrid caches, encoder-decoders with their `generation_config` as released).

Each maker builds a small model from its config (random weights, seeded). The README's list
of the families generation supports is this module's `NAMES` (tests/test_readme.py checks it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tests.differential.zoo import FAMILIES, HEADS, HIDDEN, LAYERS, VOCAB

Maker = Callable[[], torch.nn.Module]


def maker(config: str, model: str, **fields: object) -> Maker:
    """A maker of `transformers`' `model` class over `config(**fields)`, seeded, in eval mode."""

    def make() -> torch.nn.Module:
        import transformers

        torch.manual_seed(0)
        return getattr(transformers, model)(getattr(transformers, config)(**fields)).eval()

    return make


def _zoo(name: str) -> Maker:
    return lambda: FAMILIES[name].make().model


SEQ2SEQ = dict(
    vocab_size=VOCAB,
    d_model=HIDDEN,
    encoder_layers=LAYERS,
    decoder_layers=LAYERS,
    encoder_attention_heads=HEADS,
    decoder_attention_heads=HEADS,
    encoder_ffn_dim=2 * HIDDEN,
    decoder_ffn_dim=2 * HIDDEN,
    max_position_embeddings=64,
)
MAMBA2_MIXER = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1)
HYBRID = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=2 * HIDDEN,
    num_hidden_layers=4,
    num_attention_heads=HEADS,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _t5() -> torch.nn.Module:
    """A small T5 whose greedy tokens vary (a random T5 at its initial scale repeats one
    token): its weights scaled up."""
    model = maker(
        "T5Config", "T5ForConditionalGeneration", vocab_size=VOCAB, d_model=HIDDEN,
        d_ff=2 * HIDDEN, d_kv=HIDDEN // HEADS, num_layers=LAYERS, num_heads=HEADS,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )()  # fmt: skip
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0)
    return model


# families built for generation beside the zoo's, with what each exercises
EXTRA: dict[str, tuple[str, Maker]] = {
    "mpt": (
        "ALiBi from a table sized by the model's own length",
        maker(
            "MptConfig", "MptForCausalLM", vocab_size=VOCAB, d_model=HIDDEN, n_layers=LAYERS,
            n_heads=HEADS, max_seq_len=64,
        ),
    ),
    "falcon_alibi": (
        "Falcon configured with ALiBi",
        maker(
            "FalconConfig", "FalconForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN,
            num_hidden_layers=LAYERS, num_attention_heads=HEADS, alibi=True,
        ),
    ),
    "granitemoe": (
        "use_cache taken through **kwargs, experts",
        maker(
            "GraniteMoeConfig", "GraniteMoeForCausalLM", num_key_value_heads=2,
            num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB, hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
            max_position_embeddings=64,
        ),
    ),
    "jamba": (
        "hybrid cache: Mamba layers beside attention layers, experts",
        maker(
            "JambaConfig", "JambaForCausalLM", attn_layer_period=2, attn_layer_offset=1,
            expert_layer_period=2, expert_layer_offset=1, num_experts=2, mamba_d_state=8,
            mamba_expand=2, mamba_dt_rank=8, **HYBRID,
        ),
    ),
    "bamba": (
        "hybrid cache: Mamba-2 layers beside attention layers, RoPE",
        maker(
            "BambaConfig", "BambaForCausalLM", attn_layer_indices=[1, 3], mamba_expand=2,
            **MAMBA2_MIXER, **HYBRID,
        ),
    ),
    "granitemoehybrid": (
        "hybrid cache: Mamba-2 layers beside attention layers, experts",
        maker(
            "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
            layer_types=["mamba", "attention", "mamba", "attention"], mamba_expand=2,
            num_local_experts=2, num_experts_per_tok=1, shared_intermediate_size=HIDDEN,
            **MAMBA2_MIXER, **HYBRID,
        ),
    ),
    "falcon_h1": (
        "attention and Mamba-2 side by side in every layer: keys, values and states in one",
        maker(
            "FalconH1Config", "FalconH1ForCausalLM", mamba_d_ssm=2 * HIDDEN, mamba_expand=2,
            **MAMBA2_MIXER, **{**HYBRID, "num_hidden_layers": LAYERS},
        ),
    ),
    "t5": ("encoder-decoder, relative positions", _t5),
    "bart": (
        "encoder-decoder: learned positions from the cache's length, forced first and last "
        "tokens",
        maker(
            "BartConfig", "BartForConditionalGeneration", pad_token_id=1, bos_token_id=0,
            eos_token_id=2, decoder_start_token_id=2, forced_bos_token_id=0,
            forced_eos_token_id=2, **SEQ2SEQ,
        ),
    ),
    "mbart": (
        "encoder-decoder: pre-norm, a forced last token",
        maker(
            "MBartConfig", "MBartForConditionalGeneration", pad_token_id=1, bos_token_id=0,
            eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=2, **SEQ2SEQ,
        ),
    ),
    "marian": (
        "encoder-decoder: sinusoidal positions, the pad as start token",
        maker(
            "MarianConfig", "MarianMTModel", pad_token_id=VOCAB - 1, eos_token_id=0,
            decoder_start_token_id=VOCAB - 1, forced_eos_token_id=0, **SEQ2SEQ,
        ),
    ),
    "pegasus": (
        "encoder-decoder: sinusoidal positions, the pad as start token",
        maker(
            "PegasusConfig", "PegasusForConditionalGeneration", pad_token_id=0, eos_token_id=1,
            decoder_start_token_id=0, forced_eos_token_id=1, **SEQ2SEQ,
        ),
    ),
}  # fmt: skip

# the zoo's families that generate (causal LMs): each is checked for generation too
# (tests/test_generate.py checks that no other zoo family's model can generate)
ZOO = (
    "gpt2", "llama", "mistral", "gemma2", "falcon", "gpt_neox", "phi3", "opt", "bloom",
    "mixtral", "deepseek_v3", "mamba", "xglm",
)  # fmt: skip
MAKERS: dict[str, Maker] = {
    **{name: _zoo(name) for name in ZOO},
    **{name: make for name, (_, make) in EXTRA.items()},
}
ENCODER_DECODERS = ("t5", "bart", "mbart", "marian", "pegasus")
HYBRIDS = ("jamba", "bamba", "granitemoehybrid", "falcon_h1")

# how the README names each family
NAMES = {
    "gpt2": "GPT-2",
    "llama": "Llama",
    "mistral": "Mistral",
    "gemma2": "Gemma-2",
    "falcon": "Falcon",
    "gpt_neox": "GPT-NeoX",
    "phi3": "Phi-3",
    "opt": "OPT",
    "bloom": "BLOOM",
    "mixtral": "Mixtral",
    "deepseek_v3": "DeepSeek-V3",
    "mamba": "Mamba",
    "xglm": "XGLM",
    "mpt": "MPT",
    "falcon_alibi": "Falcon with ALiBi",
    "granitemoe": "GraniteMoE",
    "jamba": "Jamba",
    "bamba": "Bamba",
    "granitemoehybrid": "GraniteMoE-hybrid",
    "falcon_h1": "Falcon-H1",
    "t5": "T5",
    "bart": "BART",
    "mbart": "mBART",
    "marian": "Marian",
    "pegasus": "Pegasus",
}


def alone_tokens(
    model: torch.nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor | None,
    new: int,
    pad_token_id: int,
    **settings: object,
) -> torch.Tensor:
    """`transformers`' greedy tokens for each prompt alone and unpadded, with its own cache,
    laid out as tessel's `generate` returns a batch: `[rows, prompt + new]` (an
    encoder-decoder's `[rows, 1 + new]`, its start token first), a row that stopped at an eos
    token padded with `pad_token_id`, no column after every row stopped."""
    mask = torch.ones_like(ids) if mask is None else mask
    encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
    made, prefix = [], ids
    for row in range(len(ids)):
        alone = ids[row, mask[row].bool()][None]
        with torch.no_grad():
            out = model.generate(
                alone, attention_mask=torch.ones_like(alone), max_new_tokens=new,
                do_sample=False, pad_token_id=pad_token_id, **settings,
            )  # fmt: skip
        start = 1 if encoder_decoder else alone.shape[1]
        made.append(out[0, start:])
        if encoder_decoder:
            prefix = out[:, :1].expand(len(ids), 1)
    longest = max(len(m) for m in made)
    padded = torch.full((len(ids), longest), pad_token_id, dtype=torch.long)
    for row, tokens in enumerate(made):
        padded[row, : len(tokens)] = tokens
    return torch.cat([prefix, padded], dim=1)
