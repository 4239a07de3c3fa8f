"""The parallelism library: what the control plane and the node agents both build on.

layout    models (catalog, Hugging Face configs) as logical tensors, parallel layouts, the
          shard boxes of every rank, GPU allocation and the elastic policy (pure: no torch)
planner   the routing plan of a switch between two layouts (pure: no torch)
engine    the transition engine: runs a plan on torch.distributed, verifies it
training  the parallel trainer (TP, PP with virtual stages, DP, ZeRO 1-3, tied and
          replicated-head weights) and the multimodal trainer
emulator  the emulator: traces the trainer on fake tensors, simulates a step, searches
"""
