"""The `transformers` families generation is checked on, token for token against
`transformers`' own `generate` of each prompt alone: every causal LM of the differential suite's
zoo, and families built for generation alone (ALiBi, a model taking its arguments through
`**kwargs`, hybrid caches, encoder-decoders with their `generation_config` as released).

Each maker builds a small model from its config (random weights, seeded). The Generation guide's
list of the families generation supports (docs/guides/generation.md) is this module's `NAMES`
(tests/test_generate_families.py checks it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from tests.differential.zoo import FAMILIES, HEADS, HIDDEN, LAYERS, VOCAB

import tessel
from tessel.capture.generation import capture_gear
from tessel.config.cluster import cluster_from_dict
from tessel.config.generation import Generation
from tessel.demo import tight_cluster
from tessel.plan import has_rule

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
    num_hidden_layers=LAYERS,  # a recurrent layer, then one of attention
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
            **MAMBA2_MIXER, **{**HYBRID, "num_hidden_layers": 4},
        ),
    ),
    "granitemoehybrid": (
        "hybrid cache: Mamba-2 layers beside attention layers, experts",
        maker(
            "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
            layer_types=["mamba", "attention"], mamba_expand=2,
            num_local_experts=2, num_experts_per_tok=1, shared_intermediate_size=HIDDEN,
            **MAMBA2_MIXER, **HYBRID,
        ),
    ),
    "falcon_h1": (
        "attention and Mamba-2 side by side in every layer: keys, values and states in one",
        maker(
            "FalconH1Config", "FalconH1ForCausalLM", mamba_d_ssm=2 * HIDDEN, mamba_expand=2,
            **MAMBA2_MIXER, **HYBRID,
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

# how the Generation guide (docs/guides/generation.md) names each family
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


# the families' builds: a cache of 2 rows x 40 slots, one prefill gear of 8 tokens; 32 new
# tokens (the 8-token gear leaves the 40 slots room for 33)
GENERATION = Generation(max_batch_size=2, max_seq_len=40, prefill_lengths=(8,))
NEW = 32


def build_family(
    family: str,
    devices: int,
    memory: str,
    generation: Generation = GENERATION,
    settings: dict | None = None,
    verify: bool | None = False,
) -> tuple[torch.nn.Module, Any]:
    """The family's model and its generation package for `devices` devices of the default
    memory, or (`memory="tight"`) of the longest prompt's activations beside 1.15/N of the
    weights; `settings` go into the model's own generation_config. The build's own check
    against `transformers` is left out unless `verify` says otherwise: the tests that build
    here compare the package's tokens with `transformers`' themselves."""
    model = MAKERS[family]()
    for key, value in (settings or {}).items():
        setattr(model.generation_config, key, value)
    cluster: object = devices
    if memory == "tight":
        gear = capture_gear(model, generation, generation.prefill_lengths[-1], keep=has_rule)
        cluster = cluster_from_dict(tight_cluster(gear, devices), "tight.json")
    return model, tessel.build(model, cluster=cluster, generation=generation, verify=verify)


def family_prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of 8 and 5 tokens, the second padded on the left (no special ids)."""
    ids = torch.randint(3, VOCAB - 1, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return ids, mask


def transformers_tokens(model, ids, mask, pad_token_id: int, **settings) -> torch.Tensor:
    """transformers' greedy tokens (`NEW` of them) for each prompt alone, as tessel's are
    compared with."""
    return alone_tokens(model, ids, mask, NEW, pad_token_id, **settings)


def session_tokens(session, path, ids, mask) -> torch.Tensor:
    """The session's greedy tokens from the package at `path`, loaded for this call alone."""
    session.load_graph(0, {}, path)
    try:
        return session.generate(0, ids, attention_mask=mask, max_new_tokens=NEW)
    finally:
        session.remove_graph(0)


def generate_both_ways(family, built, path, session, *, stream=False):
    """transformers' tokens (a fresh copy of the model: the build leaves it as it was) and the
    session's for the family's prompts; with `stream`, the session's streamed steps too."""
    ids, mask = family_prompts()
    gears = built.manifest.generation
    want = transformers_tokens(MAKERS[family](), ids, mask, gears.pad_for(gears.eos_token_id))
    session.load_graph(0, {}, path)
    try:
        got = session.generate(0, ids, attention_mask=mask, max_new_tokens=NEW)
        streamed = (
            list(session.generate(0, ids, attention_mask=mask, max_new_tokens=NEW, stream=True))
            if stream
            else None
        )
    finally:
        session.remove_graph(0)
    return want, got, streamed
