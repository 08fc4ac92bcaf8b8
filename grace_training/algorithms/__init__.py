"""The training algorithms, one folder each: its loss and its step."""
