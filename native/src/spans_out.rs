//! SpanBatch records written from prepared spans: token ids as zigzag varints, each array one block with its size.
//!
//! The publisher prepares each span in Python (checked, its fields written, token ids packed as little-endian
//! int32); here a whole wave's records are finished in one call: the varints of every id, each array's block
//! header (the negated count, then the byte size), and the record's parts joined.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

/// Avro's long: zigzag, then a varint.
fn write_long(out: &mut Vec<u8>, value: i64) {
    let mut zigzag = ((value << 1) ^ (value >> 63)) as u64;
    while zigzag > 0x7F {
        out.push((zigzag as u8 & 0x7F) | 0x80);
        zigzag >>= 7;
    }
    out.push(zigzag as u8);
}

/// One non-empty id array as a sized block: header, then the ids' varints.
fn write_ids(out: &mut Vec<u8>, scratch: &mut Vec<u8>, ids: &[u8]) -> PyResult<()> {
    if ids.len() % 4 != 0 {
        return Err(PyValueError::new_err("token ids must be packed int32 (a multiple of 4 bytes)"));
    }
    scratch.clear();
    for id in ids.chunks_exact(4) {
        write_long(scratch, i64::from(i32::from_le_bytes([id[0], id[1], id[2], id[3]])));
    }
    write_long(out, -((ids.len() / 4) as i64));
    write_long(out, scratch.len() as i64);
    out.extend_from_slice(scratch);
    Ok(())
}

/// The records of `batches` (sequences of prepared spans: head, prompt ids, middle, response ids, tail, nbytes),
/// each `header` + its spans + `trailer`.
#[pyfunction]
pub fn span_records<'py>(py: Python<'py>, batches: &Bound<'py, PyAny>, headers: &Bound<'py, PyAny>,
                         trailer: &[u8]) -> PyResult<Bound<'py, PyList>> {
    let records = PyList::empty(py);
    let mut scratch = Vec::new();
    let mut headers = headers.try_iter()?;
    for batch in batches.try_iter()? {
        let header = headers.next().ok_or_else(|| PyValueError::new_err("fewer headers than batches"))??;
        let mut out = Vec::from(header.downcast::<PyBytes>()?.as_bytes());
        for prepared in batch?.try_iter()? {
            let prepared = prepared?;
            let parts = prepared.downcast::<PyTuple>()?;
            let part = |index: usize| -> PyResult<Bound<'py, PyBytes>> {
                Ok(parts.get_item(index)?.downcast_into::<PyBytes>()?)
            };
            out.extend_from_slice(part(0)?.as_bytes());
            let prompt = part(1)?;
            if !prompt.as_bytes().is_empty() {
                write_ids(&mut out, &mut scratch, prompt.as_bytes())?;
            }
            out.extend_from_slice(part(2)?.as_bytes());
            let response = part(3)?;
            if !response.as_bytes().is_empty() {
                write_ids(&mut out, &mut scratch, response.as_bytes())?;
            }
            out.extend_from_slice(part(4)?.as_bytes());
        }
        out.extend_from_slice(trailer);
        records.append(PyBytes::new(py, &out))?;
    }
    if headers.next().is_some() {
        return Err(PyValueError::new_err("more headers than batches"));
    }
    Ok(records)
}
