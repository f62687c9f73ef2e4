"""twin: a discrete-event digital twin of a GPT-style chat-serving fleet.

Kept deliberately light: importing ``twin`` (or ``twin.policies``) must not pull in simpy, pandas or
any other heavy dependency, because production routers import ``twin.policies`` unchanged.
"""

__version__ = "0.1.0"
