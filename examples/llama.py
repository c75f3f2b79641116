"""A small Llama from `transformers` with random weights: `--model=examples/llama.py:build`."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def config(layers: int = 4, hidden: int = 256, heads: int = 8, vocab: int = 8192) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )


class CausalLM(torch.nn.Module):
    """Logits only, so the model takes and returns plain tensors."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.model = LlamaForCausalLM(cfg)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def build(layers: int = 4, batch: int = 4, seq: int = 128, seed: int = 0):
    """(module, example_inputs) for `tessel build`."""
    torch.manual_seed(seed)
    cfg = config(layers)
    model = CausalLM(cfg).eval()
    input_ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    return model, (input_ids,)
