"""Layouts and strategy files, and conversion of distributed checkpoints between shardings.

Modules: layout (Layout), strategy (strategy files, tessel JSON and MindSpore protobuf),
dtensor (DTensor placements), boxes/sources/plan/convert (re-sharding checkpoints),
st_io/dcp/publish (safetensors and DCP IO, atomic publishing) and ckpt_cli (`tessel ckpt`).
The public `mindspore.parallel`-style names are exported by `tessel.parallel`.

Nothing is imported here, so the command line can load `tessel.checkpoint.ckpt_cli`
without importing torch.
"""
