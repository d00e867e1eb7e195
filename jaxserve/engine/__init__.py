"""The engine: host-side bookkeeping (sequences, pages, scheduling) around a jitted device step."""
