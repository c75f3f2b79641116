"""A small Llama from `transformers` with random weights: `--model=examples/llama.py:build`."""

import torch
from transformers import LlamaForCausalLM

from tessel.demo import llama_config


def build(layers: int = 2, batch: int = 2, seq: int = 64, seed: int = 0):
    """(module, example_inputs) for `tessel build`: the model as `transformers` gives it (tessel
    turns its cache off and takes its logits as the output)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(layers)).eval()
    input_ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    return model, {"input_ids": input_ids}
