"""Recurrent-state bytes one verify moves on a hybrid target, against the floor (chain vs tree, per knob).

Per GDN layer the committed state is S = v_heads x d_k x d_v fp32 values (2 MiB on Qwen3-Next-80B's layers).
The floor of any verify is reading the committed state once and writing the new one (plus the conv rows).
The tree scan adds a state read per resumed row (one whose parent's state is not on chip: each forward's first
row, and inner siblings after the first; held leaves cost nothing), a state write per stored row (resumed
parents and rollback checkpoints), and the commit: a copy of the accepted row's checkpoint, or a replay from its
nearest stored ancestor (one state read, one write, and the replayed rows' saved inputs). Every forward also
saves each row's scan inputs (k, v, g, beta, conv input).
"""
from __future__ import annotations

from dataclasses import dataclass

from specpilot.engines.hybrid.config import QWEN3_NEXT_80B, HybridShape
from specpilot.engines.hybrid.state import BlockSchedule, dfs_order

FP32 = 4


@dataclass(frozen=True)
class StateTraffic:
    read: int  # bytes of recurrent/conv state and saved scan inputs read, all GDN layers
    written: int
    floor: int  # read the committed state and conv rows once, write the new ones once

    @property
    def total(self) -> int:
        return self.read + self.written

    @property
    def over_floor(self) -> float:
        return self.total / self.floor


def row_input_bytes(shape: HybridShape, act_bytes: int) -> int:
    """One row's saved scan inputs: k (key heads), v, g, beta in fp32, and its conv input row."""
    return FP32 * (shape.lin_k_heads * shape.lin_k_dim + shape.lin_v_heads * (shape.lin_v_dim + 2)) \
        + shape.conv_dim * act_bytes


def verify_state_traffic(shape: HybridShape, sched: BlockSchedule, commit_row: int,
                         act_bytes: int = 2) -> StateTraffic:
    """Bytes for one verify of `sched`'s block followed by the commit of `commit_row` (act_bytes: bf16 = 2)."""
    state = shape.state_elems * FP32
    conv = (shape.conv_kernel - 1) * shape.conv_dim * act_bytes
    row_in = row_input_bytes(shape, act_bytes)
    read = sched.resumes() * state + conv
    written = sched.stored * state + sched.rows * row_in
    _, todo = sched.replay(commit_row)
    if not todo:  # the row is stored: copy its checkpoint
        read, written = read + state, written + state
    else:
        read, written = read + state + len(todo) * row_in, written + state
    read, written = read + conv, written + conv  # the committed conv rows are gathered along the accepted path
    layers = len(shape.gdn_layers)
    return StateTraffic(read * layers, written * layers, 2 * (state + conv) * layers)


def example_tree(nodes: int, depth: int) -> list[int]:
    """Draft-node parents (block-relative, root excluded, -1 = root) of a tree as best-first drafters grow it:
    a main path of `depth` nodes and the remaining nodes as alternative leaves at the shallowest depths,
    listed level by level (breadth-first), the order tree drafters emit."""
    if not 1 <= depth <= nodes:
        raise ValueError(f"depth={depth} must be in 1..nodes ({nodes})")
    alternatives = [0] * depth
    for i in range(nodes - depth):
        alternatives[i % depth] += 1
    parents, main = [], -1
    for d in range(depth):  # level d: the main node, then its alternative siblings
        parent, main = main, len(parents)
        parents += [parent] * (1 + alternatives[d])
    return parents


def block_parents(draft_parents: list[int]) -> list[int]:
    """Block rows (root first) from draft-node parents, as the engine builds them."""
    return [-1] + [p + 1 for p in draft_parents]


def state_cost_table(shape: HybridShape = QWEN3_NEXT_80B, nodes: int = 16, tree_depth: int = 8,
                     spacings: tuple[int, ...] = (1, 4, 16), chunk: int = 32) -> list[dict]:
    """Chain of `nodes` drafts vs a `nodes`-node tree (drafter order and depth-first order), per spacing: bytes of
    the worst and the mean commit over every possible accepted row, against the floor."""
    shapes = {"chain": block_parents(list(range(-1, nodes - 1))),
              "tree": block_parents(example_tree(nodes, tree_depth))}
    out = []
    for name, parents in shapes.items():
        orders = {"drafter": parents}
        if name == "tree":
            order = dfs_order(parents)
            row_of = {n: r for r, n in enumerate(order)}
            orders["dfs"] = [row_of[parents[n]] if parents[n] >= 0 else -1 for n in order]
        for order_name, par in orders.items():
            for s in spacings:
                sched = BlockSchedule.build(par, chunk=chunk, spacing=s)
                costs = [verify_state_traffic(shape, sched, r) for r in range(len(par))]
                worst = max(costs, key=lambda c: c.total)
                out.append({"block": name, "order": order_name, "spacing": s, "rows": len(par),
                            "stored": sched.stored, "resumes": sched.resumes(), "worst_bytes": worst.total,
                            "mean_bytes": sum(c.total for c in costs) // len(costs), "floor_bytes": worst.floor,
                            "worst_over_floor": round(worst.over_floor, 3)})
    return out
