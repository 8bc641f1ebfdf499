"""CUDA-graph decode (graphs): what MoEModel.decode_step replays on a GPU. The providers it replays live in
engine.tiers (resident, tiered), their kernels in engine.kernels.triton_moe."""
