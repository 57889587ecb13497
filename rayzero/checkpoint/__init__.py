"""rayzero.checkpoint"""
