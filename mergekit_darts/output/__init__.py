"""The output directory: its format (layout), the export that writes it and the model card."""
