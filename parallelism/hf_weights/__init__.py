"""Hugging Face weights in and out (docs/hf-weights.md).

Load: `hf_initial_shards(placement, rank, hf_dir)`, initial_shards' contract from a HF
directory (config.json + safetensors), each rank reading only its boxes. Export:
`export_hf` (whole tensors), `export_hf_from_checkpoint` (the project's DCP checkpoints),
`export_hf_from_shards` (a running trainer's hand_over() shards, collective).

Modules: pieces (the name/shape map's data), families (per-family adapters), convert
(tensors through a map), hf_files (a model directory's files and headers), config_rules
(config.json settings refused), config_out (config.json of an export), load, gather,
export, errors.
"""
from parallelism.hf_weights.errors import HFWeightsError
from parallelism.hf_weights.export import (export_hf, export_hf_from_checkpoint, export_hf_from_shards,
                                           plan_export)
from parallelism.hf_weights.families import detect_variant, hf_map
from parallelism.hf_weights.gather import assemble, read_checkpoint_masters
from parallelism.hf_weights.load import hf_initial_shards, hf_model_config, open_hf_source, read_hf_tensors
from parallelism.hf_weights.pieces import HFMap, Piece, Variant

__all__ = ["HFMap", "HFWeightsError", "Piece", "Variant", "assemble", "detect_variant", "export_hf",
           "export_hf_from_checkpoint", "export_hf_from_shards", "hf_initial_shards", "hf_map", "hf_model_config",
           "open_hf_source", "plan_export", "read_checkpoint_masters", "read_hf_tensors"]
