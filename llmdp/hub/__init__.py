"""Publishing: `export` (verify the run, write the folder with its card and report, push to
the Hub) and `save` (the streamed, sharded safetensors save)."""
