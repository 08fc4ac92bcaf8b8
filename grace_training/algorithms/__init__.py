"""The training algorithms, one folder each: its loss, its step and its record (``base.Algorithm``), listed in
``registry``."""
