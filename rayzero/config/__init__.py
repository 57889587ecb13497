"""rayzero.config"""
