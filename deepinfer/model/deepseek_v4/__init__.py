"""DeepSeek-V4 and V4.1: configs, weights, hybrid attention (sliding, compressed, sparse through
the indexer), their caches on the engine's paged groups, mHC, MoE, Engram, YoCo, DSpark, the vision
tower. V4.1 builds on V4's pieces, so both live in this one package."""
