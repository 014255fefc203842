"""Ranks and their collectives: where a rank sits (topology, torch-free) and the torch.distributed
process group it talks through (comm). Below the model: tensor- and expert-parallel layers use it."""
