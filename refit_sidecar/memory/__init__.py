"""Registered memory both ends use: host and tensor arenas."""
