"""Layouts and strategy files, and conversion of distributed checkpoints between shardings.

Modules: layout (Layout), strategy (strategy files, tessel JSON and MindSpore protobuf),
dtensor (DTensor placements), boxes/sources/plan/convert (re-sharding checkpoints),
st_io/dcp/publish (safetensors and DCP IO, atomic publishing), stored (a Hugging Face
checkpoint directory read a box at a time), api (the `mindspore.parallel`-style functions that
`tessel.parallel` re-exports) and cli (`tessel ckpt`).

Nothing is imported here, so the command line can load the checkpoint tools without torch.
"""
