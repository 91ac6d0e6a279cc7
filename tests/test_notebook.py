"""notebooks/quickstart.ipynb runs top to bottom (its cells assert what they show)."""

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_executes():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "served from cache" in outputs and "radix:" in outputs
