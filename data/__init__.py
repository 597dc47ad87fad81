"""data: text -> token shards -> packed windows -> deterministic, reshardable DP batches.

  tokenizer.py  ByteTokenizer, HFTokenizer, TiktokenTokenizer (K3), load_tokenizer
  sources.py    input discovery and the per-file tokenising worker
  shards.py     the on-disk shard format and its resumable writer
  prepare.py    `python -m data.prepare INPUT... --output DIR` / prepare()
  corpus.py     default_corpus_dir(): the stdlib source as an embedded corpus
  dataset.py    PackedTokenDataset: windows, labels (-100 at document starts), doc_ids
  loader.py     BatchLoader: sample order = f(seed, global position); state = global position

Submodules are imported explicitly (`from data.loader import BatchLoader`) so that the CLI does
not import torch. Nothing here imports torch.distributed.
"""
