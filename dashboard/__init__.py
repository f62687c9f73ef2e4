"""The what-if dashboard (``twin dashboard``; docs/dashboard.md).

Layers: ``tables`` turns capacity results, run summaries and drill reports into small pandas tables;
``figures`` turns tables into plotly figures (pure, tested without Streamlit); ``runs`` builds scenario
overrides and runs scenarios through ``twin.runner`` (the public API, never ``twin.models``); ``app`` and
``views/`` hold the Streamlit layout only.
"""
