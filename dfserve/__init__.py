"""dfserve: deploy DFlash drafters behind SGLang and judge them online."""

__version__ = "0.1.0"
