"""april-server: APRIL partial rollouts inside SGLang's serving layer.

Importing this package is cheap (no torch, no sglang): the client reuses
`april_client.protocol`.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
