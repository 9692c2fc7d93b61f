"""What every dialect shares: the typed state, the one generation lifecycle, security, wire
helpers (errors, timestamps, probabilities), embeddings, model facts, editor supersession."""
