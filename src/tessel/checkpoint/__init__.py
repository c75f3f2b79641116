"""Layouts and strategy files, and conversion of distributed checkpoints between shardings.

Modules: layout (Layout), strategy (strategy files, tessel JSON and MindSpore protobuf),
dtensor (DTensor placements), boxes/sources/plan/convert (re-sharding checkpoints),
st_io/dcp/publish (safetensors and DCP IO, atomic publishing), stored (a Hugging Face
checkpoint directory read a box at a time). The public `mindspore.parallel`-style names and
`tessel ckpt` are in `tessel.parallel`.

Nothing is imported here, so the command line can load the checkpoint tools without torch.
"""
