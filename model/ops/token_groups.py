"""Token groups of the expert GEMMs: one layout for every path that pads them.

The rows of an expert GEMM's input are sorted by group (expert), `sizes` [G] rows each. Each
path that needs the groups padded takes its view from one `TokenGroups`:
- flat (no host sync; the CUDA paths): group g occupies rows [start_g, start_g + size_g) of a
  [capacity, D] buffer, start_g a multiple of `align`, each group max(align, round_up(size_g,
  align)) rows, so an empty group gets `align` zero rows and no group is empty. `capacity` =
  round_up(S, align) + align * G is a bound from the shapes alone. `offs` are the int32 end
  offsets `torch._grouped_mm` / `F.scaled_grouped_mm` take. With align 32 (MXFP8's block) the
  wgrad's 32-token blocks start at every group's first token (`model.ops.mx_linear`,
  `model.ops.mx_native`).
- batched (reference paths only: float64 verification, widths `_grouped_mm` rejects): [G, R, D]
  with R = round_up(largest size, align), which is read on the host once (listed in
  `model.ops.HOST_SYNC_OPS`); `grouped_gemm`'s padded bmm (align 1) and the emulated MXFP8
  wgrad in float64 (align 32).
Both views keep the real rows in order and zeros elsewhere, so zero rows add nothing to a GEMM
and do not change an MX block's amax.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def round_up(n: Tensor | int, m: int) -> Tensor | int:
    return (n + m - 1) // m * m


class TokenGroups:
    """Where each of `num_rows` group-sorted rows goes in the padded views (module docstring)."""

    def __init__(self, group_sizes: Tensor, num_rows: int, align: int = 32) -> None:
        sizes = group_sizes.to(torch.long)
        dev = sizes.device
        self.sizes, self.G, self.num_rows, self.align = sizes, sizes.shape[0], num_rows, align
        self.group_of_row = torch.repeat_interleave(
            torch.arange(self.G, device=dev), sizes, output_size=num_rows)  # [S]
        real_starts = torch.cumsum(sizes, 0) - sizes  # [G]
        self.row_in_group = torch.arange(num_rows, device=dev) - real_starts[self.group_of_row]
        self.padded = torch.clamp(round_up(sizes, align), min=align)  # [G]
        self.ends = torch.cumsum(self.padded, 0)  # [G]
        self.starts = self.ends - self.padded  # [G]
        self.capacity = round_up(num_rows, align) + align * self.G
        self.dest = self.starts[self.group_of_row] + self.row_in_group  # [S]: flat row
        self.offs = self.ends.to(torch.int32)

    def scatter(self, t: Tensor) -> Tensor:
        """[S, D] -> [capacity, D] flat, zero padding rows."""
        return t.new_zeros(self.capacity, t.shape[1]).index_copy(0, self.dest, t)

    def gather(self, t: Tensor) -> Tensor:
        """[capacity, D] flat -> [S, D]: the real rows back."""
        return t.index_select(0, self.dest)

    def batch_rows(self) -> int:
        """R of the batched view: the largest group rounded up to `align` (one host read)."""
        largest = int(self.sizes.max().item()) if self.G > 0 else 0
        return round_up(largest, self.align)

    def batched(self, t: Tensor) -> Tensor:
        """[S, D] -> [G, R, D], zero padding rows (reads the largest group on the host)."""
        out = t.new_zeros(self.G, self.batch_rows(), t.shape[-1])
        return out.index_put((self.group_of_row, self.row_in_group), t)

    def unbatch(self, y: Tensor) -> Tensor:
        """[G, R, D] -> [S, D]: the real rows back."""
        return y[self.group_of_row, self.row_in_group]
