"""Row striding shared by our persistent backward kernels (AttnRes mix, row norms).

Program `pid` of P handles rows pid, pid + P, ... (`ROWS` = cdiv(M, P) iterations); the last
iteration may run past M: `strided_row` then points at row 0 (a valid address) and says so, and
the kernel masks every store and partial-sum contribution of that row with `valid`.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def strided_row(pid, i, P, M):
    """(row index as int64, whether it is < M) of program pid's i-th row."""
    r = pid + i * P
    valid = r < M
    return tl.where(valid, r, 0).to(tl.int64), valid
