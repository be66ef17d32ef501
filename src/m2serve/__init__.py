"""m2serve: a readable PyTorch inference and serving engine for the MiniMax-M2 family.

Layers (imports point down only): config <- formats <- model <- parallel <- engine <- serve,
and config <- text <- serve. See README.md for the map.
"""

__version__ = "0.1.0"
