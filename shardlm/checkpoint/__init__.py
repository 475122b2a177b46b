"""Checkpoints: sharded safetensors with a verified manifest, resumable at any TP x DP layout."""

from shardlm.checkpoint.files import latest_in, resolve
from shardlm.checkpoint.init import load_model
from shardlm.checkpoint.state import consolidate, load_checkpoint, save_checkpoint

__all__ = ["consolidate", "latest_in", "load_checkpoint", "load_model", "resolve", "save_checkpoint"]
