"""`train.checkpoint.release_reader`: K3's release format read through torch DCP's
HuggingFaceStorageReader.

The oracle is the model the synthetic release was written from (`tests/helpers/k3_release.py`:
bf16 text tensors, routed experts MXFP4-packed and dequantised by the compressed-tensors package).
One process: every tensor read whole, and arbitrary slices of every tensor (columns that cut
through MXFP4's 32-column groups, expert ranges of stacked weights), equal the source's exactly.
Two gloo ranks: `load_release` (plain `dcp.load`) fills FSDP2-, TP- and EP-sharded models whose
full parameters equal the source bit for bit, with each rank reading only part of the bytes;
FSDP's logits equal the source model's bit for bit, TP's and EP's loss to fp32 round-off."""

from __future__ import annotations

import torch

from tests.helpers.dist import run_ranks


def _release(tmp_path):
    from model.build import build_model
    from tests.helpers.k3_release import write_release

    source = build_model("debug", seed=3)
    folder = write_release(source, tmp_path / "release")
    return source, folder


def test_slices_equal_the_source(tmp_path):
    from train.checkpoint.release_reader import ReleaseReader

    source, folder = _release(tmp_path)
    reader = ReleaseReader(folder, source.config)
    meta = reader.read_metadata()
    state = source.state_dict()
    assert set(meta.state_dict_metadata) == set(state)
    g = torch.Generator().manual_seed(0)
    n_mx_cut = 0
    for name, want in state.items():
        assert torch.equal(reader.read_slice(name), want), name
        if want.dim() == 0:
            continue
        for _ in range(3):
            lo = [int(torch.randint(0, s, (), generator=g)) for s in want.shape]
            n = [int(torch.randint(1, s - o + 1, (), generator=g)) for s, o in zip(want.shape, lo)]
            got = reader.read_slice(name, lo, n)
            ref = want[tuple(slice(o, o + k) for o, k in zip(lo, n))]
            assert torch.equal(got, ref), (name, lo, n)
            n_mx_cut += ".experts." in name and (lo[-1] % 32 or n[-1] % 32) > 0
    assert n_mx_cut > 0  # slices did cut through MXFP4 groups
    assert reader.counts["mxfp4"] > 0 and reader.counts["skipped_vision"] == 3


def _load_sharded(rank: int, world: int, folder: str, ref_path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from model.build import build_model
    from parallel.expert_parallel import apply_expert_parallel
    from parallel.fsdp import apply_fsdp
    from parallel.tensor_parallel import apply_tensor_parallel
    from tests.helpers.tiny import packed_batch
    from train.checkpoint.release_reader import ReleaseReader, load_release

    ref = torch.load(ref_path)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    tp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    cfg = build_model("debug", device="meta").config
    whole = ReleaseReader(folder, cfg)
    for name in ref["state"]:
        whole.read_slice(name)
    layouts = {"fsdp": lambda m: apply_fsdp(m, mesh),
               "tp": lambda m: apply_tensor_parallel(m, tp_mesh),
               "ep": lambda m: apply_expert_parallel(m, mesh)}
    ids, labels, cu = packed_batch()
    for layout, apply in layouts.items():
        model = build_model("debug", device="meta")
        apply(model)
        model.to_empty(device="cpu")
        reader = load_release(model, folder, cfg)
        sharded = 0
        for name, t in model.state_dict().items():
            sharded += isinstance(t, DTensor)
            full = t.full_tensor() if isinstance(t, DTensor) else t
            assert torch.equal(full, ref["state"][name]), (layout, name)
        assert sharded > 0, layout
        limit = {"fsdp": 0.55, "tp": 0.7, "ep": 0.97}[layout]  # tp, ep replicate the rest
        assert reader.bytes_read < limit * whole.bytes_read, (layout, reader.bytes_read)
        if layout == "fsdp":
            with torch.no_grad():
                assert torch.equal(model(ids, cu), ref["logits"]), layout
        else:
            with torch.no_grad():
                loss, _ = model(ids, cu, labels=labels)
            torch.testing.assert_close(loss, ref["loss"], rtol=1e-5, atol=1e-5)


def test_sharded_loads_equal_the_source(tmp_path):
    from tests.helpers.tiny import packed_batch

    source, folder = _release(tmp_path)
    ids, labels, cu = packed_batch()
    state = {k: v.clone() for k, v in source.state_dict().items()}  # forwards count routes
    with torch.no_grad():
        ref = {"state": state, "logits": source(ids, cu),
               "loss": source(ids, cu, labels=labels)[0]}
    torch.save(ref, tmp_path / "ref.pt")
    run_ranks(_load_sharded, 2, str(folder), str(tmp_path / "ref.pt"))
