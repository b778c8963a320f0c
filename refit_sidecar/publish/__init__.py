"""A trainer rank's publishing end: its shards laid out in registered slots."""
