"""Every daemon setting: one typed field each, and the config built from them."""
