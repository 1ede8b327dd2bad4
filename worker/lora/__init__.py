"""LoRA adapters in the worker: `formats` reads and checks the files users
bring, `layers` applies an adapter to the model unfused, `swap` loads new
versions off the token path and swaps them in between steps."""
