"""rayzero.engine"""
