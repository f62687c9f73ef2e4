"""twin's what-if dashboard: ``twin dashboard`` (or ``streamlit run dashboard/app.py``); docs/dashboard.md.

Layout only. The pages in ``views/`` lay out controls and figures; the numbers come from the capacity
model and from scenario runs (``dashboard.runs``), the tables from ``dashboard.tables`` and the figures
from ``dashboard.figures`` and ``twin.charts``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # streamlit puts this file's folder on sys.path, not the repository root
    sys.path.insert(0, str(ROOT))

import streamlit as st  # noqa: E402

# The page files live in views/, not pages/: Streamlit treats a pages/ folder beside the main script as a
# legacy multipage app, which showed a second navigation and "Page not found" on direct page URLs.

st.set_page_config(page_title="twin what-if dashboard", layout="wide")
PAGES = [
    st.Page("views/capacity.py", title="Capacity planner", url_path="capacity", default=True),
    st.Page("views/whatif.py", title="What-if simulation", url_path="what-if"),
    st.Page("views/drill.py", title="Drill replay", url_path="drill"),
    st.Page("views/policies.py", title="Policy comparison", url_path="policies"),
]
st.navigation(PAGES).run()
