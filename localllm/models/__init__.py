"""Model files: the catalog, GGUF metadata, the store on disk, pulling and quantizing."""
