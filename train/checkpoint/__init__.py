"""Weights on disk: the run's own sharded checkpoints and Hugging Face's format both ways.

- `checkpointer.py`: `Checkpointer`, DCP checkpoints of the whole train state (atomic publish,
  checksums, keep-K, asynchronous saves, any layout loads any other);
- `import_hf.py`: `python -m train.checkpoint.import_hf` (K3's release or our export -> a run
  directory that pretraining continues);
- `release_reader.py`: the release read through DCP's `HuggingFaceStorageReader` in our names
  (`checkpoint.init_from`: each rank reads its own slices);
- `export_hf.py`: `python -m train.checkpoint.export_hf` (a checkpoint -> K3 safetensors);
- `sample.py`: `python -m train.checkpoint.sample` (text from a checkpoint, a sanity look).
"""
