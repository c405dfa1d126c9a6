//! EP logic: config, plan math, Buffer, dispatch/combine. (Being written: issues 3-5.)
