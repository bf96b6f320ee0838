"""Generation: sampling, the decode step and the generation loop."""
