"""A Datasette plugin that shows the integer codes of a gradstore database as names: `role`, `status` and `dtype`
in the `tensors` view and `tensor_data`, `dtype` in `layouts`, `kind` in `nodes` ("grad_output (0)" where the
cell holds 0). `gradstore datasette` registers it; it changes only how the cells are drawn in the HTML pages (the
JSON and CSV keep the numbers, which the lookup tables roles, statuses, dtypes and kinds name).

Relies on Datasette's `render_cell(row, value, column, table, database, datasette)` plugin hook (0.65).
"""

from __future__ import annotations

try:
    from datasette import hookimpl
except ImportError:  # without Datasette the module still imports (nothing calls the hook then)

    def hookimpl(fn):
        return fn


from gradstore.records import DTYPES, KINDS, ROLES, STATUSES

# table -> column -> names by code (the codes of gradstore.records, frozen per schema revision)
LABELS = {
    "tensors": {"role": ROLES, "status": STATUSES, "dtype": DTYPES},
    "tensor_data": {"role": ROLES, "status": STATUSES},
    "layouts": {"dtype": DTYPES},
    "nodes": {"kind": KINDS},
}


def label(table: str | None, column: str, value) -> str | None:
    """'grad_output (0)' for a code that `LABELS` names, else None (Datasette draws the cell as usual)."""
    names = LABELS.get(table or "", {}).get(column)
    if names is None or isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < len(names):
        return None
    return f"{names[value]} ({value})"


@hookimpl
def render_cell(row, value, column, table, database, datasette):
    """Datasette's hook: the name of a code cell of a gradstore table or view (see `label`)."""
    return label(table, column, value)
