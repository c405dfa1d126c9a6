//! The exported C ABI (`fep_*`). (Being written: issue 6.)
