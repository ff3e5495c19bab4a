"""The client half of SGLang's protocol; its names are re-exported by `dfserve.sglang`."""
