"""Hooks that plug shardwise into training frameworks (see :mod:`shardwise.integrations.slime`)."""
