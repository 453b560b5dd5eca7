"""Test support: multi-rank harness, tiny models, NCCL's p2p rules on gloo, Bridge on CPU
(docs/architecture.md, "Layers"). Never imported by product code."""
