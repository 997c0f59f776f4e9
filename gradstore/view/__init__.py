"""Pictures of a record: `heatmap` and `history` (matplotlib), `graph` (Graphviz), the self-contained HTML
report (`report_html`, `write_report`; `gradstore report`) and Datasette over a database (`gradstore datasette`).

The plotting libraries are the optional extra `gradstore[view]` (matplotlib, graphviz) and Datasette the extra
`gradstore[datasette]`; each is imported when a picture is asked for, so `import gradstore.view` needs neither,
and a missing one is a MissingDependency naming the extra to install.
"""

from .backward_graph import graph
from .html_report import report_html, write_report
from .plots import heatmap, history

__all__ = ["heatmap", "history", "graph", "report_html", "write_report"]
