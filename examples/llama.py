"""A small Llama from `transformers` with random weights: `--model=examples/llama.py:build`."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tessel.demo import llama_config


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
    cfg = llama_config(layers)
    model = CausalLM(cfg).eval()
    input_ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    return model, (input_ids,)
