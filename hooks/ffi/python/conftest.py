# Makes `import probity` find the package beside this file when pytest runs from anywhere.
