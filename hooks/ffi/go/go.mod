module example.invalid/probity/ffi

go 1.19
